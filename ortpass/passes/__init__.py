"""ortpass's built-in passes, one module per pass.  Importing this package registers them."""

from ortpass.passes.base import CREATED_BY_KEY, OrtFunctionalPass, OrtPass
from ortpass.passes.build_training_graph import BuildTrainingGraphPass

__all__ = ["BuildTrainingGraphPass", "CREATED_BY_KEY", "OrtFunctionalPass", "OrtPass"]
