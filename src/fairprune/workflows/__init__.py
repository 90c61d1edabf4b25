"""What a command runs: vision pruning and comparison, LM post-training pruning, head pruning
(FASP), the Diff-Pruning comparison. Workflows return report objects and write them at the edge."""
