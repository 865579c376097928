"""Shipped recipes (YAML), installed as package data so `specdistill distill --recipe code` finds them."""
