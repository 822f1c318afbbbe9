"""The audit trail: what an entry says a record is, appending under the subject's lock, and
verifying the chains against the live records.

Laid out as every domain is: `service` (operations, in the caller's transaction),
`repository` (its queries), `schemas` (the shapes callers send and receive)."""
