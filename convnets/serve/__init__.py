"""Serving a classifier on the Triton Inference Server (``convnets serve``), over KServe v2 HTTP and gRPC.

* :mod:`~convnets.serve.repository`: the model repository ``convnets serve`` writes: a Python-backend
  model around a convnets classifier (:class:`~convnets.serve.repository.ServedModel`: what it
  loads and how it runs), its ``config.pbtxt`` and labels;
* :mod:`~convnets.serve.backend`: that model's code, run by Triton's Python backend (encoded images
  in, probabilities and top-k classes out, an error per bad request);
* :mod:`~convnets.serve.server`: runs the Triton binary that the ``serve`` extra (PyTriton) installs
  on a repository, on unix sockets only its user can reach: readiness, a private ``/dev/shm``, restarts,
  signals and clean-up;
* :mod:`~convnets.serve.front`: the HTTP, gRPC and metrics proxies clients reach, which refuse what
  would crash Triton or fill its memory before it parses anything.

Nothing here imports PyTorch or PyTriton until it is used.
"""
