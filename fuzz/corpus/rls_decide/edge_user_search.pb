
edge


useru1

routesearch


useru1

routeitem