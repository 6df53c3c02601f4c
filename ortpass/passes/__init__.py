"""ortpass's built-in passes, one module per pass.  Importing this package registers them."""

from ortpass.passes.base import CREATED_BY_KEY, OrtFunctionalPass, OrtPass

__all__ = ["CREATED_BY_KEY", "OrtFunctionalPass", "OrtPass"]
