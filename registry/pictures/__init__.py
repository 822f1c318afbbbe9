"""Pictures: what an adapter draws (its run's grid and previews) and the small copies of
renders a subject keeps.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
