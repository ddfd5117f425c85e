"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with its statuses.

The gateway answers every refusal with ``ApiError``; the ``openai`` client turns the
status into its own exception class (400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 503 ``InternalServerError``), and
its ``code``/``param`` attributes come from the body. Messages never hold an API key.
"""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER = "server_error"


class ApiError(Exception):
    """A request the gateway refuses or could not serve, as OpenAI reports one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str, code: str = "invalid_api_key") -> ApiError:
    return ApiError(401, message, type=AUTHENTICATION, code=code)


def context_length_exceeded(message: str, param: str = "messages") -> ApiError:
    return ApiError(400, message, param=param, code="context_length_exceeded")
