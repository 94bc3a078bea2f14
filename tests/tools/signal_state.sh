#!/bin/sh
# Test tool (case F10): prints this process's blocked and ignored signal sets as JSON,
# {"SigBlk": HEX, "SigIgn": HEX}, read from /proc with shell builtins only (awk, say,
# ignores SIGPIPE itself), so what it shows is what the tool inherited.
while read -r key value; do
    case $key in
        SigBlk:) blk=$value ;;
        SigIgn:) ign=$value ;;
    esac
done < /proc/$$/status
printf '{"SigBlk": "%s", "SigIgn": "%s"}\n' "$blk" "$ign"
