"""Deployment: `hyperswap install` / `uninstall`, the systemd units they write, and the units' start gate."""
