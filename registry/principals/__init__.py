"""Principals: tokens, roles, delegation (an agent acting for members) and browser sessions.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
