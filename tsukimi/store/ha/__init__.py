"""High availability of the store master: leader election and an operation log in etcd."""
