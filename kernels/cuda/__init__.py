"""The CUDA backend: `verify.cu` compiled at run time with NVRTC (`nvrtc.py`), launched by
`backend.CudaBackend`. Nothing here is imported until the "cuda" backend is asked for."""
