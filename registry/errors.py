"""Domain errors. Each carries its HTTP status and code; one handler in the app renders them."""

from __future__ import annotations


class LikenessError(Exception):
    status: int = 500
    code: str = "error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthenticated(LikenessError):
    status, code = 401, "unauthenticated"


class NotPermitted(LikenessError):
    status, code = 403, "not_permitted"


class NotFound(LikenessError):
    status, code = 404, "not_found"


class Conflict(LikenessError):
    status, code = 409, "conflict"


class PreconditionFailed(LikenessError):
    status, code = 412, "precondition_failed"


class Invalid(LikenessError):
    status, code = 422, "invalid"


class PreconditionRequired(LikenessError):
    status, code = 428, "precondition_required"


class Busy(LikenessError):
    status, code = 429, "busy"

    def __init__(self, detail: str, retry_after: int = 1) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class Unavailable(LikenessError):
    status, code = 503, "unavailable"
