"""Serving a classifier on the Triton Inference Server (``convnets serve``), over KServe v2 HTTP and gRPC.

* :mod:`~convnets.serve.repository`: the model repository ``convnets serve`` writes: a Python-backend
  model around a convnets classifier (:class:`~convnets.serve.repository.ServedModel`: what it
  loads and how it runs), its ``config.pbtxt`` and labels;
* :mod:`~convnets.serve.backend`: that model's code, run by Triton's Python backend (encoded images
  in, probabilities and top-k classes out, an error per bad request);
* :mod:`~convnets.serve.server`: :class:`~convnets.serve.server.TritonServer`: Triton on unix sockets only
  its user can reach, behind the fronts: readiness, supervision and restarts, signals and clean-up;
* :mod:`~convnets.serve.launch`: the Triton binary that the ``serve`` extra (PyTriton) installs,
  started with a private ``/dev/shm`` (util-linux ``unshare``) and stopped by process group;
* :mod:`~convnets.serve.front`, :mod:`~convnets.serve.http_front`, :mod:`~convnets.serve.grpc_front`:
  the HTTP, metrics and gRPC fronts clients reach, which parse and check each request and send
  Triton one they build (:mod:`~convnets.serve.upstream`: over HTTP), within bounds on connections,
  bytes and time across all clients; :mod:`~convnets.serve.fronts` runs them.

Nothing here imports PyTorch or PyTriton until it is used.
"""
