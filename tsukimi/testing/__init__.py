"""tsukimi's testing kit, shipped in the package (as trio ships `trio.testing`) so the tests,
the benchmarks and anyone embedding tsukimi share one set of helpers and conformance suites.

Modules (import what you need from each; nothing is re-exported here, so that
`python -m tsukimi.testing.layers` stays light):
    processes         polling, stopping children, the JSON-lines child handle
    deployments       the store deployed: TsukimiCluster (master + holders as real processes),
                      and the shapes the store suite runs on (in-process, real processes)
    assertions        `raises`, and running a list of named checks
    engine_pairs      pairs of Transfer Engines per transport setting
    transport_checks  the Transfer Engine conformance suite: `check_transport(make_pair)`
    store_checks      the store semantics suite: `check_store(make_deployment)`
    layers            the import-structure check (`python -m tsukimi.testing.layers`)
"""
