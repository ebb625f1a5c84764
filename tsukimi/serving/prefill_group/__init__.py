"""The CPP prefill group: `tsukimi prefill-stage` processes, stage 0 the head the router sees."""
