"""Input backends that training and evaluation share: batches (:mod:`~convnets.data.batches`), class
folders scanned (:mod:`~convnets.data.scan`) and their loaders (:mod:`~convnets.data.folders`), DALI pipelines (:mod:`~convnets.data.dali`)."""
