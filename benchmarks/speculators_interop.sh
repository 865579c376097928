#!/usr/bin/env bash
# Check our vLLM (speculators) EAGLE-3 export against the real `speculators` package.
#
#   bash benchmarks/speculators_interop.sh            # venv in /tmp/specvenv (reused)
#   SPECVENV=/path/to/venv bash benchmarks/speculators_interop.sh
#
# speculators is not a project dependency: its metadata pins torchvision / torchaudio, which
# would pull a CUDA torch. So it goes into an isolated virtualenv that sees the system
# site-packages (torch, transformers, this project), installed with --no-deps; its other
# requirements that are missing are installed by hand after a dry run shows that none of them
# would bring a torch. Then runs `python -m pytest -m interop tests/interop -q` in that venv.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${SPECVENV:-/tmp/specvenv}"
PY="${PYTHON:-python}"
SPECULATORS_VERSION="$("$PY" -c 'from specdistill.drafts.eagle3.checkpoint import SPECULATORS_VERSION as v; print(v)')"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
    # Where $PY is itself a virtualenv's, --system-site-packages reaches the base interpreter's
    # packages, not $PY's (torch, transformers, this project): add $PY's site-packages, with
    # its .pth files (the editable install), behind the new venv's own.
    PARENT="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    CHILD="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if [ "$PARENT" != "$CHILD" ]; then
        echo "import site; site.addsitedir('$PARENT')" > "$CHILD/zz-parent-site.pth"
    fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
TORCH_BEFORE="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"

"${PIP[@]}" install --quiet --no-deps \
    "speculators==$SPECULATORS_VERSION" "hs-connectors==$SPECULATORS_VERSION"

# speculators' own requirements (not extras) whose distribution is not installed at all;
# torch / torchvision / torchaudio are never installed here (the system torch is used).
mapfile -t MISSING < <("$VENV/bin/python" - <<'EOF'
import re
from importlib.metadata import PackageNotFoundError, requires, version

skip = {"torch", "torchvision", "torchaudio", "hs-connectors"}
for req in requires("speculators") or []:
    if "extra ==" in req:
        continue
    spec = req.split(";")[0].strip()
    name = re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0]
    if name.lower() in skip:
        continue
    try:
        version(name)
    except PackageNotFoundError:
        print(spec)
EOF
)

if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "installing speculators requirements missing here: ${MISSING[*]}"
    PLAN="$("${PIP[@]}" install --dry-run "${MISSING[@]}" 2>&1 | grep '^Would install' || true)"
    echo "${PLAN:-nothing to install}"
    if echo "$PLAN" | grep -Eiq '(^| )(torch|torchvision|torchaudio|triton|nvidia-[^ ]*)-[0-9]'; then
        echo "refusing: installing ${MISSING[*]} would replace torch or pull CUDA packages" >&2
        exit 1
    fi
    "${PIP[@]}" install --quiet "${MISSING[@]}"
fi

TORCH_AFTER="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
    echo "torch changed in $VENV ($TORCH_BEFORE -> $TORCH_AFTER); remove the venv" >&2
    exit 1
fi
"$VENV/bin/python" -c 'import speculators, importlib.metadata as m; print("speculators", m.version("speculators"), "torch", __import__("torch").__version__, "transformers", m.version("transformers"))'

exec "$VENV/bin/python" -m pytest -m interop tests/interop -q "$@"
