"""The client of a wedlm-cluster coordinator: gRPC only, no MLX (see `client.py`)."""

from common.generation_params import GenerationParams
from wedlm_client.client import ClusterError, WedlmClient, final_dict, job_dict

__all__ = ["ClusterError", "GenerationParams", "WedlmClient", "final_dict", "job_dict"]
