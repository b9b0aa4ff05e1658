/*
 * daemon/config.h: the config file (nbdcached.conf(5)), an INI file read
 * with inih, merged with the command line into one struct options.
 *
 * Owns: the file's syntax and its keys. A [generic] section holds global
 * settings; every other section is an export named by its title. Where
 * nbd-server has a key for the same thing (exportname, readonly, listenaddr,
 * port, maxconnections, user, group, unixsock) it is accepted under that
 * name, so an nbd-server config mostly works; nbd-server keys nbdcached
 * cannot honour are refused by name. Every error names FILE:LINE.
 *
 * Called from main() at start and from the reload path (SIGHUP, control
 * socket) on the main thread; not thread-safe, and needs not be.
 */
#ifndef NBDCACHED_DAEMON_CONFIG_H
#define NBDCACHED_DAEMON_CONFIG_H

#include <stddef.h>

#include "daemon/options.h"

/*
 * The whole configuration: the command line, the config file it names
 * (--config, or OPTIONS_DEFAULT_CONFIG when it exists and the command line
 * gives no export), then options_finish(). The command line wins for every
 * global setting it gives; the file's exports come first, then the command
 * line's. On error returns -EINVAL (or -ENOMEM) with one line in err.
 */
int config_options(int argc, char **argv, struct options *out, char *err, size_t errlen);

/* Merge one config file into opts (exposed for tests). */
int config_load(const char *path, struct options *opts, char *err, size_t errlen);

#endif
