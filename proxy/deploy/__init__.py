"""Deployment: `hyperswap install` / `uninstall`, the systemd units, the start gate, pod attribution's wiring."""
