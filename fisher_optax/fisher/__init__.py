"""The Fisher toolkit: the paper's structured Fisher approximations as analysis tools,
the other half of the package beside the optimizers.

- :mod:`fisher_optax.fisher.fim`: dense empirical Fisher matrices of small layers and
  each structure's optimum, the paper's propositions executable (arXiv:2502.07752,
  Sec. 2-5).
- :mod:`fisher_optax.fisher.structure_errors`: the same questions for real layers, from
  products with the gradients, without forming ``mn x mn`` matrices.
- :mod:`fisher_optax.fisher.fisher_report`: a whole model's report -- for every matrix
  the error of each structure against its empirical Fisher -- over training batches.
- :mod:`fisher_optax.fisher.structure_choice`: a structure per matrix under a memory
  budget, from a report.
"""
