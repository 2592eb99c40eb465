"""Speculative decoding: proposers (n-gram lookup, draft models), the adaptive
draft-count rule and the typed configuration. Verification lives in
engine/sampling/rejection.py; drafted tokens are scheduled as more "next
tokens" of their request (engine/scheduler.py)."""
