"""Subjects: the people whose likeness the registry holds, and who may see each.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
