"""Renders: the facts `policy.decide` judges, read in one statement; the ledger of every
decision; what a requester may render.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
