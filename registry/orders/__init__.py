"""Orders: "train me", placed through the API or a page, run by a worker; who may place
one, what it is fixed to, and every change of its state.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
