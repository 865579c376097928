"""The online demo (`specdistill online demo`): a server (serve/) and the online job
(train/online/) run together on shifting traffic, against OSD's policy. A layer above serve
and train, which never import each other: cli.py (its parser and entry), demo.py (the run),
training.py (the target's adapter, the fit draft, the two jobs' recipes), loadgen.py (the
prompt pools and the clients), report.py (served α, the windows around the shift, the plot).
"""
