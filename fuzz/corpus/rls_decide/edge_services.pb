
edge

serviceimporter

servicehealthcheck