"""What predict, embed and explain take as inputs, and how they name them in files.

:mod:`~convnets.inputs.listing` lists the inputs (files, folders, URLs, ``--from-file`` lists) lazily and
in batches; :mod:`~convnets.inputs.names` writes their names into files reversibly and makes file names of
them. Below every feature that reads inputs (inference, explanations); no PyTorch, no Pillow.
"""
