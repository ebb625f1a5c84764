"""tsukimi's testing kit, shipped in the package (as trio ships `trio.testing`).

Modules (import what you need from each; nothing is re-exported here, so that
`python -m tsukimi.testing.layers` stays light):
    layers            the import-structure check (`python -m tsukimi.testing.layers`)
"""
