"""`tsukimi up`: the cluster's plan of processes and their supervisor."""
