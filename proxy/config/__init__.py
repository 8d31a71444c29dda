"""tenants.json: what it may hold, how it is read and merged over the shipped defaults, what its
errors say, and the `Registry` the proxy runs from.

- `units`, `bounds`: bytes at the edge, and the range every number in the file must be in.
- `fields`: the strict model base and the small value rules (host:port, URLs, device lists).
- `schema`: a tenant, the base of every release kind, `release` as the union of a closed set of
  kinds, and the whole file (`Config`).
- `kinds`: that closed set (`ReleaseKinds`), a value handed to loading, never a global.
- `settings`: the other sections (admin, proxy, telemetry, gpu_profile).
- `jsonfile`: reading JSON that names a key twice, NaN, or nests too deep as an error.
- `merge`: the user's file over the defaults, field by field, remembering who set what.
- `messages`: pydantic's errors as the one-line messages people read.
- `registry`: the merged, validated tenants (`Registry`) and their provenance.
- `loading`: reading, merging and checking a file with the release kinds it is given
  (`load_registry`, `registry_from_dict`, `load_registry_over`); proxy/engines/loading.py binds the
  proxy's kinds (proxy/engines/release_kinds.py). Nothing here imports proxy.engines or proxy.lifecycle.

A tenant describes an application (how to recognise its processes, where it listens, how much it
matters, how to ask it for memory back), never code. The engine kind only selects an adapter in
`proxy.engines`; nothing here knows what an engine does.
"""
