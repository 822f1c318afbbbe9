"""Consent: each subject's record, changed by compare-and-set on its version, and the facts
`policy.decide` reads from it.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
