"""The online job: refreshes a served draft from the server's traffic log (`job.py`), gated
(`gate.py`), published as versions (`versions.py`), watched (`watch.py`). The guide:
docs/online.md."""
