"""The host rules moved to the core (proxy/hosts.py), where engines/ and gpu/ may use them too.

Only relay/listener.py still imports them from here: it is being rewritten, and imports
proxy.hosts once it is; then delete this module."""

from proxy.hosts import HostPolicy

__all__ = ["HostPolicy"]
