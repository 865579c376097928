"""Shipped recipes (YAML), installed as package data: `--recipe code` names
`code.yaml` here when no file of that name exists."""
