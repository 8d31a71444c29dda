"""Model files in host RAM: each tenant's model files as its adapter finds them (`catalog`, which asks
`EngineAdapter.model_files`), how much of each is in the page cache (`pagecache`), reading them in
ahead of a load (`warm`), and how fast loads ran (`loads`).

A load reads its file at memory speed when the file is in the page cache and at disk speed when it is
not; a handoff costs what the next load costs, so this is where the proxy can win time back."""
