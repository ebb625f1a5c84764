"""tsukimi's testing kit, shipped in the package (as trio ships `trio.testing`) so the tests,
the benchmarks and anyone embedding tsukimi share one set of helpers and conformance suites.

Modules (import what you need from each; nothing is re-exported here, so that
`python -m tsukimi.testing.layers` stays light):
    processes         free loopback ports, polling, stopping children, the JSON-lines child handle
    cluster           a store (master + holders) in real processes on loopback
    deployments       the store's deployment shapes: in-process, and real processes
    assertions        `raises`, and running a list of named checks
    engine_pairs      pairs of Transfer Engines per transport setting
    transport_checks  the Transfer Engine conformance suite: `check_transport(make_pair)`
    store_checks      the store semantics suite: `check_store(make_deployment)`
    layers            the import-structure check (`python -m tsukimi.testing.layers`)
"""
