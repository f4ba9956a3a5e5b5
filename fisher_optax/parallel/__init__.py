"""Running the optimizers sharded: the state's partition specs and shardings derived from
the parameters' (``sharding``), and the structured rule run on ``Auto`` mesh axes under an
``Explicit`` mesh (``explicit_axes``), and whole-matrix work on the matrices' owner
devices (``owners``). Nothing here changes an update's mathematics."""
