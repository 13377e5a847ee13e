"""One instrumented forward + backward pass: the engine, its instruments, device choice and admission."""
