"""The store of states: the token-exact checkpoint index (index), the tensors it holds on the device and in the host
tier (store, tiers), the byte budgets (budget), the cold-state policy (policy) and the home of a state among workers
(routing). Knows tensors and bytes, not forwards: nothing here runs the model (statecache.run does), and nothing here
is imported eagerly by this package, so the torch-free scheduler can read the index."""
