#!/bin/sh
# Test tool (case F9): prints a partial result and fails at once with exit 3.
echo '{"partial": true}'
exit 3
