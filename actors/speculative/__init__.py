"""Speculative decoding: drafts (prompt lookup, MTP), one verify pass over them, exact
acceptance, and the policy that decides whether speculating pays (docs/speculative.md)."""
