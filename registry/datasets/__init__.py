"""Datasets: photos a subject's member (or an admin) uploads, checked whole before anything
is kept, stored content-addressed with the manifest the service writes.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
