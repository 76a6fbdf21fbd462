"""Input backends that training and evaluation share: batches (:mod:`~convnets.data.batches`), class
folders and their loaders (:mod:`~convnets.data.folders`), DALI pipelines (:mod:`~convnets.data.dali`)."""
