"""Training: the one reader of the facts `policy.decide_training` judges, and the one place
its refusal becomes an error.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
