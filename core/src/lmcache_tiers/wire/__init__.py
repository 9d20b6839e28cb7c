"""The native wire format, shared by the client and the server.

``protocol`` holds the request/reply Structs and their msgpack codecs; ``shm`` maps the
server's L1 shared-memory segment and views caller buffers as bytes.  Neither imports the
server, so a client (or another front end) depends on this package alone.
"""
