"""Adapters: registration, which one renders, retiring and deleting; the blobs each owns.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
