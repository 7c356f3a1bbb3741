/*
 * libxinfer-example-nosym.so: a shared library that is not a backend (it does not export
 * xinfer_backend_init). The loader must say so, naming the file and the missing symbol.
 */
__attribute__((visibility("default"))) int xinfer_example_not_a_backend(void) { return 42; }
