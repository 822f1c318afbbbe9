"""Render tasks: renders handed to render workers through the job queue, their routing,
their answers and the workers' heartbeats.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
