"""kvtune.kernels: the MLA verify-attention contract, its backends and the serving runtime.

Never imports the tuner, Optuna or pandas.
"""
__version__ = "0.1.0"  # keep equal to pyproject.toml's version

from .api import describe_problem, verify_attention, workspace_bytes
from .backends import Backend, SplitTable, backend_names, get_backend, params_from_dict, register_backend
from .inputs import VerifyInputs, make_inputs, rel_error
from .reference import reference_attention
from .shapes import ModelShape, VerifyProblem
from .tree import chain_parents, random_parents, tree_mask_from_parents
from .triton_params import TritonParams

__all__ = [
    "verify_attention", "workspace_bytes", "describe_problem", "tree_mask_from_parents", "chain_parents",
    "random_parents", "ModelShape", "VerifyProblem", "Backend", "SplitTable", "get_backend",
    "register_backend", "backend_names", "params_from_dict", "make_inputs", "VerifyInputs", "rel_error",
    "reference_attention", "TritonParams",
]

