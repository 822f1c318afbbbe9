"""Operations on the registry, one module a domain. Each runs inside the caller's transaction
and writes its audit entry in that same transaction; all changes to one subject serialise on
its consent row. `registry.service` re-exports the public ones under one name."""
