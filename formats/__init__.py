"""The file formats the server and the online job share, with their readers: the traffic
record (`traffic.py`), the traffic log's shards (`traffic_shards.py`) and the published
draft versions (`published.py`: the version names, `manifest.json`, ROOT/current).

What only one side does stays with it: writing the traffic log and hot swap in serve/,
publishing and rolling back versions in train/online/. This layer depends on nothing in the
project but specdistill.errors (tests/test_layout.py)."""
