"""The gRPC API (gthulhu.node.v1.NodeAgent); generated code lives in gen/ and is made by the build."""
