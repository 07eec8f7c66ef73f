"""The engine under the public API (internal): IO thread, sockets, envelope, auth, the
multicast tree, supervision and the rank process.  It never imports the layers above it."""
